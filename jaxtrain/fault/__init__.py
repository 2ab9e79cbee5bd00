"""Everything that happens when a host fails or misbehaves: the hang watchdog (`watchdog.py`),
the preflight health check (`preflight.py`), straggler detection (`stragglers.py`), stopping
together on a signal (`preemption.py`), drills (`chaos.py`) and the cross-process host values they
share (`hostcomm.py`)."""
