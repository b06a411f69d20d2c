"""What the load tests share: workloads, the offline fleet simulator, HTTP/SSE clients, statistics and
report writers. Nothing here is a command; the commands are the modules one level up
(``python -m loadtests.<script>``, listed in ``loadtests/README.md``)."""
