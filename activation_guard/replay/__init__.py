"""Replay: re-run a layer call on the golden's own inputs to say where a difference was made."""
