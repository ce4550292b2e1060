"""swaprl's version. It lives here, not in `__init__.py`, so that the package's own modules can import it
without a cycle."""

__version__ = "0.1.0"
