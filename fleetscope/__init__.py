"""fleetscope: see inside ML jobs across a GPU fleet."""
