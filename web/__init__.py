"""The upload page's static files, the wheel's package data ``mm_serve.web`` (this file makes the
folder a package that ``importlib.resources`` finds in an editable install too)."""
