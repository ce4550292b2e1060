"""What swaprl uses of its dependencies beyond their documented surface, one module per dependency, each gated by
the versions it was checked against."""

from __future__ import annotations


def in_range(version: str, supported: str) -> bool:
    """Whether `version` lies in the PEP 440 specifier `supported`; development and local builds (2.13.0+cpu,
    0.26.1.dev3) count as their base release, an unparsable version as outside."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).base_version in SpecifierSet(supported)
    except InvalidVersion:
        return False
