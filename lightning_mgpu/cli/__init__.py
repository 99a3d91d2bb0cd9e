"""The ``lightning-mgpu`` command line. Each subcommand lives in its own module."""
