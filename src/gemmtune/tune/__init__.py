"""Tuning: the one engine (``engine``, its worker processes, records and progress), its command
line (``command``), and tune-triton, which runs the engine and exports Triton JSON configs. It
knows no family: the CLI hands it a family's tuner class (``family.FamilyTuner``)."""
