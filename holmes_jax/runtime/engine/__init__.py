"""The pipeline engine: mesh, stage layout, the tick loop and its ops, ZeRO-1, encoded
island crossings, and what a compiled program sends.
"""
