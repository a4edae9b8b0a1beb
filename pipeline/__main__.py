"""`python -m pipeline` is the `pipe` command (also what torchrun launches)."""

from pipeline.cli import main

if __name__ == "__main__":
    main()
