"""Online learning algorithms on an eligibility-trace graph."""
