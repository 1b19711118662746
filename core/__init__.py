"""Sans-IO core: geometry, planning and protocol state machines. No I/O, threads or clocks here."""
