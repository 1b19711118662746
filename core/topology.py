"""Who talks to whom for every room: the one place the deployment's wiring is derived.

``core.geometry.links`` says which prefill rank sends which heads to which decode rank. From it,
this module builds what each side's room machine is told when a room opens:

- a decode rank gets one ``SenderSpec`` per prefill rank it pairs with (real senders and dummies,
  the head range each writes, which one carries the aux row, and how many TransferInfos that
  prefill rank waits for);
- a prefill rank gets the decode ranks it serves (``receivers``), which lets it ask for staging
  space before their TransferInfos arrive.

The threaded runtime, the simulator and the tests all call these functions, so a wrong count
(an MLA dummy, a replicated head) is wrong everywhere at once and caught by every test.
"""

from __future__ import annotations

from kvferry.core.events import SenderSpec
from kvferry.core.geometry import ModelGeometry, receivers_for, senders_for
from kvferry.core.messages import Endpoint

__all__ = ["receiver_endpoints", "sender_specs"]


def sender_specs(
    model: ModelGeometry, prefill_tp: int, decode_tp: int, decode_rank: int, prefill_server: str = "prefill"
) -> tuple[SenderSpec, ...]:
    """The prefill ranks decode rank ``decode_rank`` pairs with; the first real sender (lowest
    prefill rank) carries the aux row."""
    specs = []
    aux_given = False
    for link in senders_for(model, prefill_tp, decode_tp, decode_rank):
        aux = not link.is_dummy and not aux_given
        aux_given = aux_given or aux
        specs.append(
            SenderSpec(
                endpoint=Endpoint(server=prefill_server, rank=link.prefill_rank),
                dummy=link.is_dummy,
                expected_infos=len(receivers_for(model, prefill_tp, decode_tp, link.prefill_rank)),
                send_aux=aux,
                head_start=link.head_start,
                num_heads=link.num_heads,
            )
        )
    return tuple(specs)


def receiver_endpoints(
    model: ModelGeometry, prefill_tp: int, decode_tp: int, prefill_rank: int, decode_server: str = "decode"
) -> tuple[Endpoint, ...]:
    """The decode ranks prefill rank ``prefill_rank`` sends real data to (dummy links excluded)."""
    return tuple(
        Endpoint(server=decode_server, rank=x.decode_rank)
        for x in receivers_for(model, prefill_tp, decode_tp, prefill_rank)
        if not x.is_dummy
    )
