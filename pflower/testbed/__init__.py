"""The testbed: what robustness, straggler and scale experiments attach to the production
path from outside, never imported by it. Byzantine clients and the simulated omniscient
adversary (``attacks``: ``OmniscientAttack``, a stage of the reply pipeline), stragglers
(``stragglers``), the experiment ClientApp and ServerApp that attach them around the
production ones (``client_app``, ``server_app``), and ``LocalGrid``, an in-process grid that
runs a real ClientApp without an engine (``local_grid``)."""
