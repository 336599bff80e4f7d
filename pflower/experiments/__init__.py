"""Pieces for experiments, out of the production path: Byzantine clients and the simulated
omniscient adversary (``attacks``), stragglers (``stragglers``), and ``LocalGrid``, an
in-process grid that runs the real ClientApp without an engine (``local_grid``)."""
