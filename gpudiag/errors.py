"""The one exception type for failures a user can act on.

The CLI turns a GpudiagError into one line on stderr and exit code 2; anything
else that escapes is a bug and is reported as an internal error.
"""


class GpudiagError(Exception):
    """A user-facing failure: bad input, a missing resource, an impossible configuration.

    The message must say what is wrong and, where it can, what to do instead.
    """

    exit_code = 2
