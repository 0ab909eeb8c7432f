"""Pictures of what ran: all-reduce animations, pipeline Gantt charts, device timelines.

Views only consume schedules, traces and results files; they never recompute what they show.
"""
