"""Pieces for experiments, out of the production path: Byzantine clients and the simulated
omniscient adversary (``attacks``), stragglers (``stragglers``), the experiment ClientApp that
attaches both around the production one (``client_app``), and ``LocalGrid``, an in-process
grid that runs a real ClientApp without an engine (``local_grid``)."""
