"""What sets up a process before and around training: the launcher's environment contract (`env`),
exit codes (`exit_codes`), XLA:CPU flags (`xla_cpu`), the host allocator (`host_malloc`),
`jax.distributed` start-up (`distributed`), barriers that name missing processes (`multihost`),
the persistent compilation cache (`compilation_cache`) and the host-to-host messages of the
fault layer (`hostcomm`).
"""
