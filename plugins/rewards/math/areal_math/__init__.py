"""Math and format rewards for areal.

Nothing is imported here: areal imports ``areal_math.hooks`` on every
``areal`` call and the rewards only when a run selects them.
"""
