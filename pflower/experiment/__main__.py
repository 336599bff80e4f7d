"""``python -m pflower.experiment FILE [options]``."""

from pflower.experiment.command import main

if __name__ == "__main__":  # not in the runs' worker processes (spawn imports this module)
    raise SystemExit(main())
