"""The one exception type the fronts turn into a clear one-line message."""


class ModelError(Exception):
    """A model file, folder, architecture or input that edgetp cannot use, and why.

    The message is written for the person at the terminal: it names the file or key and says what
    was expected, so the CLI prints it as is, without a traceback.
    """


class HubUnreachable(ModelError):
    """The hub could not be reached from this device (no route, refused, timed out): another
    device that can reach it may fetch in its place."""
