"""The engine on a GPU: Triton kernels for the KV write and paged attention (attention.py), the small
ops (ops.py, cpu/ops.Ops' interface), a step's inputs in one copy to the device (step.py) and decode
steps replayed as CUDA graphs (graphs.py). Imported only where triton is installed; on a CPU the tests
run these kernels in Triton's interpreter."""
