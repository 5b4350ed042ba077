"""One module per `hybridpipe` subcommand: argument parsing and file I/O at the edge."""
