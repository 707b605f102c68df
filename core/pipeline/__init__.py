"""Pipeline parallelism: schedules as pure action lists, one executor, and a simulator."""
