"""A shared GPU's descriptor work, processor-shared over time (backends/simfabric/posting.py):
with ``FabricSpec.one_gpu`` and ``NicSpec.shared_desc_ns`` a post's descriptors go at
``1 / max(own, k * shared)`` a ns while k posts are posting, k recomputed whenever one joins or
leaves. Checked against an independent reading of the model (each post's descriptors are the
integral of that rate from its start to its end), against the closed form where k never changes,
and against a copy of the old pricing (k fixed at a post's start), which the check must catch."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, replace
from fractions import Fraction

import numpy as np
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.backends.simfabric.descriptors import DescList
from kvferry.backends.simfabric.fabric import Fabric
from kvferry.backends.simfabric.spec import FabricSpec, NicSpec

NODES = ("a", "b", "c", "d")


@dataclass(frozen=True)
class Post:
    at: int  # when the node posts it
    node: str
    n: int  # descriptors
    read: bool  # a READ from the next node (posts at read_desc where set)


@dataclass(frozen=True)
class Costs:
    post_cost: int
    per_desc: int
    read_desc: int
    shared: int

    def own(self, p: Post) -> int:
        return self.read_desc if p.read and self.read_desc else self.per_desc


def _spec(c: Costs, one_gpu: bool = True) -> FabricSpec:
    nic = NicSpec(
        bandwidth_bps=10**15,
        latency_ns=0,
        jitter_ns=0,
        post_cost_ns=c.post_cost,
        per_desc_ns=c.per_desc,
        read_desc_ns=c.read_desc,
        shared_desc_ns=c.shared,
        max_inflight=1000,
    )
    return FabricSpec(nic=nic, prepped=False, one_gpu=one_gpu)


def _spaced(n: int) -> DescList:
    off = np.arange(n, dtype=np.int64) * 16
    return DescList.of([0] * n, off, [0] * n, off, [8] * n)


def _peer(node: str) -> str:
    return NODES[(NODES.index(node) + 1) % len(NODES)]


def run(posts: list[Post], spec: FabricSpec, crash: tuple[int, str] | None = None) -> list[int]:
    """Each post's end of posting (ns), in ``posts``' order; posts at one ns are made in order."""
    env = simpy.Environment()
    fab = Fabric(env, spec, random.Random(0))
    for name in NODES:
        fab.add_node(name)
        fab.register(name, 0, 1 << 16)
    xids: list[int] = [0] * len(posts)

    def make(i: int) -> None:
        p = posts[i]
        if not fab.nodes[p.node].up:
            xids[i] = -1
            return
        src, dst = (_peer(p.node), p.node) if p.read else (p.node, _peer(p.node))
        xids[i] = fab.post(p.node, src, dst, _spaced(p.n), None)

    for i, p in enumerate(posts):
        fab._at(p.at, make, i)
    if crash is not None:
        fab._at(crash[0], fab.crash, crash[1])
    env.run()
    return [fab.xfers[x].ready_ns if x in fab.xfers else -1 for x in xids]


def old_pricing(posts: list[Post], c: Costs, one_gpu: bool = True) -> list[int]:
    """The fabric's posting before this model (a copy): k fixed when a post begins, counted from
    the nodes whose last post ends after that."""
    busy = dict.fromkeys(NODES, 0)
    out = []
    for p in sorted(posts, key=lambda p: p.at):  # stable: posts at one ns in order
        begin = max(p.at, busy[p.node])
        per_desc = c.own(p)
        if c.shared:
            k = 1 + sum(1 for n in NODES if n != p.node and busy[n] > begin) if one_gpu else 1
            per_desc = max(per_desc, c.shared * k)
        busy[p.node] = begin + c.post_cost + per_desc * p.n
        out.append(busy[p.node])
    order = sorted(range(len(posts)), key=lambda i: posts[i].at)
    ends = [0] * len(posts)
    for j, i in enumerate(order):
        ends[i] = out[j]
    return ends


def phases(posts: list[Post], ends: list[int], c: Costs) -> list[tuple[int, int]]:
    """Each post's descriptor phase [start, end): it begins when the node's previous post ended
    (or when it is made), after the fixed cost."""
    last = dict.fromkeys(NODES, 0)
    out: list[tuple[int, int]] = [(0, 0)] * len(posts)
    for i in sorted(range(len(posts)), key=lambda i: posts[i].at):
        p = posts[i]
        begin = max(p.at, last[p.node])
        out[i] = (begin + c.post_cost, ends[i])
        last[p.node] = ends[i]
    return out


def model_violations(posts: list[Post], ends: list[int], c: Costs) -> list[int]:
    """The posts whose end is not the model's: the descriptors worked over [start, end), at
    1 / max(own, k(t) * shared) a ns with k(t) the posts in their phase at t, must reach n at the
    end and not one ns before it (its end is the exact end rounded up)."""
    ph = phases(posts, ends, c)
    cuts = sorted({t for s, e in ph for t in (s, e)})
    bad = []
    for i, p in enumerate(posts):
        s, e = ph[i]
        if p.n == 0:
            if e != s:
                bad.append(i)
            continue
        if e <= s:
            bad.append(i)
            continue

        def worked(until: int, i: int = i, s: int = s) -> Fraction:
            total = Fraction(0)
            pts = [s] + [t for t in cuts if s < t < until] + [until]
            for t0, t1 in itertools.pairwise(pts):
                k = sum(1 for a, b in ph if a <= t0 < b)
                total += Fraction(t1 - t0, max(c.own(posts[i]), k * c.shared))
            return total

        if not worked(e) >= p.n > worked(e - 1):
            bad.append(i)
    return bad


@st.composite
def schedules(draw: st.DrawFn, max_posts: int = 8) -> tuple[list[Post], Costs]:
    c = Costs(
        post_cost=draw(st.integers(0, 40)),
        per_desc=draw(st.integers(1, 30)),
        read_desc=draw(st.sampled_from([0, 0, 7, 19])),
        shared=draw(st.integers(1, 30)),
    )
    posts = [
        Post(
            draw(st.integers(0, 3_000)),
            draw(st.sampled_from(NODES)),
            draw(st.integers(0, 80)),
            draw(st.booleans()),
        )
        for _ in range(draw(st.integers(1, max_posts)))
    ]
    return posts, c


@settings(max_examples=300, deadline=None)
@given(schedules())
def test_every_post_ends_where_the_shared_rate_says(case: tuple[list[Post], Costs]) -> None:
    posts, c = case
    assert model_violations(posts, run(posts, _spec(c)), c) == []


@settings(max_examples=150, deadline=None)
@given(schedules(), st.integers(0, 50))
def test_a_post_alone_costs_the_closed_form_exactly(case: tuple[list[Post], Costs], gap: int) -> None:
    """Posts one after another (each made after the one before ended): k = 1 throughout, the old
    formula to the ns."""
    posts, c = case
    spaced, t = [], 0
    for p in posts:
        t += gap
        q = replace(p, at=t)
        spaced.append(q)
        t += c.post_cost + max(c.own(q), c.shared) * q.n
    assert run(spaced, _spec(c)) == old_pricing(spaced, c) == _closed(spaced, c, 1)


def _closed(posts: list[Post], c: Costs, k: int) -> list[int]:
    return [p.at + c.post_cost + max(c.own(p), k * c.shared) * p.n for p in posts]


@settings(max_examples=150, deadline=None)
@given(
    st.integers(2, 4),
    st.integers(1, 80),
    st.integers(0, 40),
    st.integers(1, 30),
    st.integers(1, 30),
    st.integers(0, 1_000),
)
def test_posts_overlapping_over_their_whole_length_each_pay_k_times_the_device(
    k: int, n: int, post_cost: int, per_desc: int, shared: int, at: int
) -> None:
    """The closed form max(per_desc, k * shared) each (the old pricing gave the first of them k = 1:
    the others were not posting yet when it began)."""
    c = Costs(post_cost, per_desc, 0, shared)
    posts = [Post(at, node, n, False) for node in NODES[:k]]
    assert run(posts, _spec(c)) == _closed(posts, c, k)


@settings(max_examples=150, deadline=None)
@given(schedules())
def test_a_device_bound_gpu_works_without_pause_and_a_cpu_bound_post_never_waits_on_it(
    case: tuple[list[Post], Costs],
) -> None:
    """Conservation. Device-bound (own <= shared): while any post is in its phase the device
    works at its full rate, so the phases' union lasts sum(shared * n), up to each end's rounding
    (< 1 ns a post). CPU-bound (own >= 4 * shared, four nodes): k never matters, every post costs
    own * n after its fixed cost, as alone."""
    posts, c = case
    dev = replace(c, per_desc=min(c.per_desc, c.shared), read_desc=min(c.read_desc, c.shared))
    ph = [(s, e) for s, e in phases(posts, run(posts, _spec(dev)), dev) if e > s]
    union, reach = 0, -1
    for s, e in sorted(ph):
        union += max(0, e - max(s, reach))
        reach = max(reach, e)
    work = sum(dev.shared * p.n for p in posts)
    assert work <= union < work + max(1, len(posts))
    cpu = replace(c, per_desc=4 * c.shared + c.per_desc, read_desc=0)
    assert run(posts, _spec(cpu)) == old_pricing(posts, replace(cpu, shared=0))


def test_the_check_catches_pricing_a_post_at_its_start() -> None:
    """The old pricing on a partial overlap: a posts alone at first and keeps its k = 1 price while b
    posts beside it; b pays k = 2 for its whole length though a ends halfway. The model check
    flags both; the fabric passes it, and both end earlier than b did there."""
    c = Costs(post_cost=10, per_desc=4, read_desc=0, shared=5)
    posts = [Post(0, "a", 1_000, False), Post(2_500, "b", 1_000, False)]
    old = old_pricing(posts, c)
    assert old == [10 + 5_000, 2_500 + 10 + 10_000]
    assert model_violations(posts, old, c) == [0, 1]
    new = run(posts, _spec(c))
    assert model_violations(posts, new, c) == []
    # a: 500 descriptors alone, then 500 at 10 ns; b: 500 at 10 ns beside a, 500 alone at 5 ns
    assert new == [10 + 2_500 + 5_000, 2_510 + 5_000 + 2_500]


@settings(max_examples=150, deadline=None)
@given(schedules(), st.booleans())
def test_without_a_shared_device_the_post_times_are_the_old_ones(
    case: tuple[list[Post], Costs], one_gpu: bool
) -> None:
    """shared_desc_ns 0 (most profiles), or each node on a GPU of its own: the old formula, and
    the shared device is never used."""
    posts, c = case
    plain = replace(c, shared=0)
    assert run(posts, _spec(plain, one_gpu)) == old_pricing(posts, plain, one_gpu)
    assert run(posts, _spec(c, one_gpu=False)) == old_pricing(posts, c, one_gpu=False)


def test_a_crashed_nodes_post_leaves_the_device_and_the_others_speed_up() -> None:
    c = Costs(post_cost=0, per_desc=1, read_desc=0, shared=10)
    posts = [Post(0, "a", 100, False), Post(0, "b", 100, False), Post(0, "b", 50, False)]
    # both at 20 ns a descriptor until a dies at 400 (20 descriptors each), then b alone at 10
    assert run(posts, _spec(c), crash=(400, "a")) == [-1, 400 + 80 * 10, 1_200 + 50 * 10]
    assert run(posts, _spec(c)) == [2_000, 2_000, 2_500]
