"""Datasets: record arrays written once, sealed, then read in an order known per epoch."""
