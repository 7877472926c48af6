"""Custom policies for the registry tests, written the way the reference's section 6 shows.

Importing ``custom_policy_pkg.reference_style`` registers ``my_policy`` through the decorator;
``custom_policy_pkg.by_path`` registers nothing and is reached only as a ``module:Class`` string.
"""
