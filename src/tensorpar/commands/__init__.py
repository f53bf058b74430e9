"""One module per `tensorpar` command; each has add_parser(subparsers) and a run(args, argv)."""
