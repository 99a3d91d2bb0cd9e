"""The ``lightning-mgpu`` command line. Each subcommand lives in its own module; ``main.py`` is the
entry point, ``_errors.py`` says which errors are the user's (one line, no traceback)."""
