"""The daemon: HTTP API (`app`), auth, the scheduled sweep and the service lifecycle (`main`)."""
