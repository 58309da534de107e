"""`python -m glmvit_cupy.cli`: glmvit-encode, as its console script runs it."""

if __name__ == "__main__":
    from . import command

    raise SystemExit(command())
