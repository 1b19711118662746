"""Transfer flows: how one chunk of a room gets from prefill pages into decode pages.

The room machines (``core.sender``, ``core.receiver``) own a room's lifecycle; a flow owns its
chunk ledger and tells the room only "chunk landed" or "chunk failed, why". See DESIGN section 9.
"""

from kvferry.core.flows.policy import BUILT_FLOWS, FLOW_NAMES, Flow, FlowError, FlowPolicy, staging_format

__all__ = ["BUILT_FLOWS", "FLOW_NAMES", "Flow", "FlowError", "FlowPolicy", "staging_format"]
