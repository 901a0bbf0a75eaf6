"""Drive a cluster from another machine over ssh (docs/remote.md): snapshot (the code a job
runs, frozen at submit), ssh (the one way to the login host), handle (the local stub of a
remote run), proxy (submit, status, watch, report, ctl and cancel run there)."""
