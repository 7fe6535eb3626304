"""The one training loop that every distribution model plugs into."""
