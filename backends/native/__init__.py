"""The native transfer engine: C source (engine.c), built into ``_kvf_engine`` at install."""
