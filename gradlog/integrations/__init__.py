"""Callbacks for training frameworks that own the loop; each module imports its framework on import."""
