"""Building blocks shared by proposer plugins."""
