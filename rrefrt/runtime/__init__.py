"""One worker's runtime: its threads and the parts they run.

The composition root (``root.Runtime``) builds every part and hands each its typed
collaborators; see the map at the top of docs/design.md for which thread runs what.
"""
