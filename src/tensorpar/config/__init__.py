"""Plain data at the bottom of the package: the choices every command offers, the command options, and the
GPU catalog. Nothing here imports the rest of tensorpar."""
