"""Figures for people: the scaling estimate and the run report."""
