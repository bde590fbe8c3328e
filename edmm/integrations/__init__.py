"""Integrations of EDMM into other serving engines.

Each subpackage imports its engine only inside itself: ``import edmm`` never needs them.
"""
