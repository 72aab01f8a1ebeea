-- Argo CD health of a sessionfleet.dev/v1alpha1 AgentSession, from the phase and
-- conditions the operator writes. Lua 5.1, the dialect of Argo CD's gopher-lua.
local hs = {}

local function condition(status, kind)
  if status.conditions == nil then
    return nil
  end
  for _, c in ipairs(status.conditions) do
    if c.type == kind then
      return c
    end
  end
  return nil
end

local function explain(c, fallback)
  if c ~= nil and c.message ~= nil and c.message ~= "" then
    return c.reason .. ": " .. c.message
  end
  if c ~= nil and c.reason ~= nil then
    return c.reason
  end
  return fallback
end

local status = obj.status
if status == nil or status.phase == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to bind the session"
  return hs
end

local valid = condition(status, "Valid")
if valid ~= nil and valid.status == "False" then
  hs.status = "Degraded"
  hs.message = explain(valid, "The spec is invalid")
  return hs
end

local phase = status.phase
local ready = condition(status, "Ready")
if phase == "Bound" then
  hs.status = "Healthy"
  hs.message = "Bound to worker " .. (status.worker or "?")
elseif phase == "Finished" then
  hs.status = "Healthy"
  hs.message = explain(ready, "Finished")
elseif phase == "Lost" then
  hs.status = "Degraded"
  hs.message = explain(ready, "The session's worker is gone")
elseif phase == "Pending" or phase == "Migrating" or phase == "Restoring" then
  hs.status = "Progressing"
  hs.message = explain(ready, phase)
else
  hs.status = "Unknown"
  hs.message = "Unknown phase " .. phase
end
return hs
