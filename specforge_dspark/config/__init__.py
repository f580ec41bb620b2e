"""The recipe: one typed dataclass per YAML section (sections.py, servers.py,
companions.py), the strict loader that names an unknown or bad key by its dotted path
(strict_load.py, recipe.py), the checks across sections (validate.py), and the argument
parser every command uses (command_line.py). The lowest layer: every other may use it.

Imports: none
"""
