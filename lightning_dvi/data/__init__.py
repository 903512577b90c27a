"""Data: toy generator and LightningDataModules (toy, UCI, digits)."""
