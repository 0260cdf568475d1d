"""The planner (`--mode=plan`): memory, FLOP, communication and time model, search, XLA checks."""
