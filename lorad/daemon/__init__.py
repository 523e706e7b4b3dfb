"""The coordinator process (`lorad`): HTTP API, tokenization, streaming, and the workers' lifetime.

Never imports `lorad.workers` or torch: workers are separate processes reached only through
`lorad.protocol`.
"""
