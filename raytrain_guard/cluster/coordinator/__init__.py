"""The run's coordinator: reports in, policy rounds, decisions out, their effects measured."""
