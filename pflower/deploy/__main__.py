"""``python -m pflower.deploy credentials|connection|gateway|up|down ...``."""

from pflower.deploy.command import main

if __name__ == "__main__":
    main()
