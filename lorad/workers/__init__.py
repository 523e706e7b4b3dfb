"""The worker process: one rank of the tensor-parallel model and its step loop.

Started by the coordinator as `python -m lorad.workers --config FILE --rank R`. Never imports
`lorad.daemon`.
"""
