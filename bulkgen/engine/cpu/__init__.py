"""The engine on a CPU: our C kernels (csrc/, compiled on first use for the machine it runs on:
kernels.py), the small ops behind one interface (ops.py), which path each kernel family takes here
(paths.py, measured by race.py), and what the CPU can do (machine.py)."""
