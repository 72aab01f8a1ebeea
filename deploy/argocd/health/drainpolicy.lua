-- Argo CD health of a sessionfleet.dev/v1alpha1 DrainPolicy. A policy is
-- configuration: Healthy once accepted, Degraded when the operator finds it invalid
-- or in conflict with another policy. Lua 5.1, the dialect of Argo CD's gopher-lua.
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

local status = obj.status or {}

local valid = condition(status, "Valid")
if valid ~= nil and valid.status == "False" then
  hs.status = "Degraded"
  hs.message = explain(valid, "The spec is invalid")
  return hs
end

local conflict = condition(status, "Conflict")
if conflict ~= nil and conflict.status == "True" then
  hs.status = "Degraded"
  hs.message = explain(conflict, "Another DrainPolicy selects the same workers")
  return hs
end

local generation = obj.metadata.generation
if status.observedGeneration ~= nil and generation ~= nil and status.observedGeneration < generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to act on generation " .. generation
  return hs
end

hs.status = "Healthy"
if status.matchedWorkers ~= nil then
  hs.message = "Selects " .. status.matchedWorkers .. " worker(s), " .. (status.activeDrains or 0) .. " draining"
else
  hs.message = "Mode " .. (obj.spec.mode or "WaitThenMigrate") .. ", deadline " .. (obj.spec.deadline or "10m")
end
return hs
