"""The front end, in the caller's process: input processing, output processing, the client. No torch."""
