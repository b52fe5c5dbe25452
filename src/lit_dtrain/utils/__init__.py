"""Small measurement and helper utilities shared by lit_dtrain's techniques, tests and scripts."""
