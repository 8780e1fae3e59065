"""Any layer output as addressed leaves, and the way back from leaves to a call's structures."""
