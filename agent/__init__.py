"""The per-node agent: collection loop, three-colour tracker, store and exporters."""
