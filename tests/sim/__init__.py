"""A deterministic-per-seed simulation of Sluice's delivery protocol (issue 28, part 2).

A seeded scheduler drives api, worker and reader actors one broker call at a time against a
real redis-server, through the real broker code and Lua scripts, injecting faults between
steps, and checks the exactly-once invariants after every step and at the end. A failing seed
is shrunk to a minimal replay. `world.py`: the actors and faults; `invariants.py`: the checks;
`run.py`: the scheduler, replay and shrinking; `test_simulation.py`: the bounded CI run.
"""
